"""Entry points that can run an engine in this process: ``llm`` (the offline ``LLM``) and ``cli``
(the ``tandem`` command, whose ``backend`` and ``generate`` run one).

The only frontend code allowed to import the engine (the import contract in
pyproject.toml names the two imports), and only lazily, inside the functions
that need it: importing any frontend module, these included, never imports
torch. Nothing else in the frontend imports from here but ``frontend.LLM``, lazily too.
"""
