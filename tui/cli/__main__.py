from tui.cli.main import app

app()
