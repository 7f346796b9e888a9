"""What one engine step hands down (scheduler -> executor -> worker) and back: ``SchedulerOutput``,
the grammar masks, ``ModelRunnerOutput``. Both sides import these, so every layer imports downward.

Imports: backend.types (and torch, for the masks).
"""
