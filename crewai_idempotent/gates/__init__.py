"""Approvals and spend caps: the stage the ledger drives between a claim and its body."""
