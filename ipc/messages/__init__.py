"""Typed wire records, one module per receiving process.

Every record is a `msgspec.Struct` tagged with its class name, so one decoder per socket
can tell the record types that socket accepts apart and reject anything else.
"""
