"""llmchat's terminal front end: the Textual app and the `llmchat` command line."""
