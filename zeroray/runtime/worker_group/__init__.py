"""The worker group: the actors of one world size, placed, called, watched for failures, re-formed."""
