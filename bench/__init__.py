"""Benchmarks and checks: commands that measure the product; not part of the installed package."""
