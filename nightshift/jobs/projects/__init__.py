"""Projects (the unit of tenancy) and the API keys that act for them."""
