from vaeopt.cli import run

run()
