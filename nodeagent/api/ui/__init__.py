"""The status page served by the agent at GET /ui (static files in `static/`) and the hit-rate history behind
its plot (GET /cache)."""
