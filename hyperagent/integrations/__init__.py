"""What training frameworks add to be tuned by hyperagent (``hyperagent.integrations.torch``).

Each integration is imported on its own, so this package needs none of the frameworks.
"""
