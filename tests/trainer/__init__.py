"""The trainer's modules, in process on 8 simulated CPU devices."""
