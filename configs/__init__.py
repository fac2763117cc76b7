"""Example job configs shipped with flowrl (data only): ``flowrl train arithmetic``."""
