"""One param group, the unit that is gathered and reduced together: built or adopted
from a module's parameters (``param_group``), its parameters as views of the group
buffers (``params``), its layout key (``layout``), the unshard / reshard transitions
(``unshard``), gradient buffers and the post-backward reduction (``gradients``,
``grad_buffers``, ``grad_dtypes``), the gradients it holds unreduced between
backwards (``grad_state``), and the two strategies a group holds, with their
interfaces and default implementations: how its shards are held and gathered
(``gather``: ``GatherStrategy``, ``RowGather``) and how its parameters map onto its
rows (``sharding``: ``Sharding``, ``Dim0Sharding``).
"""
