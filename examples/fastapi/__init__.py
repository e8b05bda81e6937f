"""A FastAPI service that dispatches kumiko jobs from ``async def`` endpoints."""
