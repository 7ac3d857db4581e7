"""Text data."""
