"""`llmchat top`: a live view of a server's load (figures.py: the text; app.py: the view)."""
