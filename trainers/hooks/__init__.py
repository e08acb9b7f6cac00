"""What the loop does beside stepping, each on its own: the non-finite loss policy and the rest of its hooks."""
