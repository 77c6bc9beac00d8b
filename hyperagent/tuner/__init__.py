"""Closed-loop tuning of distributed-training settings: the search space (``space``), the
optimiser (``optimizer``), one trial's measurement and score (``trial``) and the journal.

Nothing is imported here: the agent uses ``trial`` alone and must not load scikit-optimize.
"""
