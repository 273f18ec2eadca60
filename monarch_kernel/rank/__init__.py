"""Rank runtime: runs actors and cells inside one forked rank process."""
