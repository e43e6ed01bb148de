"""The decode batch on the host: requests and their handles, the row book (which request
each row holds and where its K/V sits), the prefix cache's book of blocks."""
