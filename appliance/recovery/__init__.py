"""What an engine fault costs a request: kept to a pause, and never a crash loop."""
