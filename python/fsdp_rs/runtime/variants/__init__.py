"""Groups that differ from the plain one: all-gather extensions (``extensions``, the
``ExtensionGather`` strategy), ``Shard(d)`` placements (``shard_dim``, the
``DimSharding`` strategy), DTensor parameters on N-D meshes (``nd``),
spmd_types annotations (``spmd_annotations``), and one group per dtype driven as one
(``bundle``).
"""
