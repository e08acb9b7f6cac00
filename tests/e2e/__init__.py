"""The commands as users run them, and the docs' code blocks."""
