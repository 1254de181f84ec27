from vaeopt.cli import app

app()
