"""The operator CLI (typer + rich)."""
