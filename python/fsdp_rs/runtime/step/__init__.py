"""One training step as the module hooks drive it: the hooks, the root and lazy init
(``state``), tensors in module inputs and outputs (``containers``), the order of the
backward's groups (``backward_order``), who ends a backward (``finalize``), each
group's training state and the phase questions (``training_state``), and profiler
labels and logs (``observe``). ``docs/step.md`` walks a step through them.
"""
