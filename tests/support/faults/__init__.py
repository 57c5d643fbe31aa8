"""Fault injection with real processes: a worker that can be killed at named points, a fake
provider that records every effect durably, and the fault matrix built on both."""
