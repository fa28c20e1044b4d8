"""Helpers the tests share: spawned gloo groups, probes run on their ranks, fake trials,
a study builder, PostgreSQL and Chromium drivers. Not tests themselves."""
