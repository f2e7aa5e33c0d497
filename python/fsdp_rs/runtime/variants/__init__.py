"""Groups that differ from the plain one: all-gather extensions (``extensions``),
``Shard(d)`` placements (``shard_dim``), DTensor parameters on N-D meshes (``nd``),
spmd_types annotations (``spmd_annotations``), and one group per dtype driven as one
(``bundle``).
"""
