"""distillq library: transport, keys, teacher backends, scoring, rollout tracking, feeder, learner client."""
