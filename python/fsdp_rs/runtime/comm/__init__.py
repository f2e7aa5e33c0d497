"""Collectives and where they run: meshes and their process groups (``mesh``),
all-gather / reduce-scatter calls and gradient divide factors (``collectives``), custom
collectives (``comms``), side streams and cross-stream lifetimes (``streams``).
"""
