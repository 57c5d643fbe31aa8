"""crewAI runs that need no network: the demos and the self-test, on a scripted model."""
