"""torch.compile: what Dynamo must not trace in eager hooks (``eager``), the hooks
traced into a graph (``traced``), DTensor and extension handling under trace
(``traced_dtensor``, ``traced_extension``).
"""
