"""rampserve on Ray Serve: replicas of the whole server, and the controller actor a model's replicas share."""
