"""The library as a user's own loop meets it: plans, ops, following, big_vision's drop-in."""
