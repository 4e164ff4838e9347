"""Operations: what the admin, the API and the commands call; each writes its own audit event."""
