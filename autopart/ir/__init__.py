"""The plain values that pass between autopart's passes and that every rank loads.

Plans and their parts, tensor metadata, placements, schedule actions, the model-file loader
and the errors. This package imports only torch and the standard library, so that the runtime,
which imports nothing above it, starts without the compiler.
"""
