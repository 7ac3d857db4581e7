"""Know before you launch: the bytes one rank holds at the peak of a recipe's training step under each layout
the launcher has, found by running the step on fake tensors (nothing allocated), and the layout to use.
`python -m launcher.plan RECIPE --devices N --memory 80GB`; a run checks the plan against its measured peak."""
