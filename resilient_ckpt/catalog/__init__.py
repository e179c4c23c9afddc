"""What each tier holds as this process sees it, which steps are viable, which
copies failed their checks, and what retention deletes."""
