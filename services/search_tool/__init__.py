"""mempo search_tool service."""
