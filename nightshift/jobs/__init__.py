"""Domain layer, one package per concept: projects (and their API keys), files, batches,
schedules, costs. Functions take the caller's ``Session`` and never commit: the API request,
the Celery task (``nightshift.workers``) or the CLI owns the transaction. No torch here."""
