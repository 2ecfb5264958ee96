"""Apparate's controller as pure logic: records in, configurations out; no threads, no I/O."""
