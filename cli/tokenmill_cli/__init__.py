"""tokenmill's command line (typer)."""
