"""One training step as the module hooks drive it: the hooks, the root and lazy init
(``state``), tensors in module inputs and outputs (``containers``), the order of the
backward's groups (``backward_order``), who ends a backward (``finalize``), and
profiler labels and logs (``observe``). ``docs/step.md`` walks a step through them.
"""
