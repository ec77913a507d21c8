from tui.cli import run

run()
