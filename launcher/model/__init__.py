"""What is done to a model, below the strategies and checkpoints that use it. `step` turns a batch into a
loss (`launcher.model.step.Supervised`, `ModelLoss`); `precision` is autocast, fp16's grad scaler and
fp8's Float8Linear; `recompute` is activation checkpointing; `empty` builds a model on the meta device
and materialises it; `modules` finds layers by class; `plain` is the plain model behind every wrapper
and its state_dict with the wrappers' prefixes removed."""
