"""Model-free benchmark helpers: seeded request traces and SLO metrics on request timelines."""
