"""A step's peak memory predicted from the plans before it runs (``memory_plan``),
and what the forward leaves for backward, measured on a copy that holds no memory
(``activation_profile``).
"""
