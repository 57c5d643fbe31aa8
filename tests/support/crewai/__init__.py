"""Support code for the crewai integration tests: a scripted model, fake providers."""
