"""vrnic.db."""
