"""The status page: its document, the recent-history ring behind its charts, its routes, ui/."""
