"""Object store backends (S3, local folder) and database engine/session setup."""
