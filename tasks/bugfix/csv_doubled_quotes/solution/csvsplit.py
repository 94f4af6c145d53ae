"""A minimal CSV line splitter (RFC 4180 quoting, one line at a time)."""


def split_fields(line: str, sep: str = ",") -> list[str]:
    fields, current, in_quotes = [], [], False
    i = 0
    while i < len(line):
        char = line[i]
        if in_quotes:
            if char == '"' and line[i + 1:i + 2] == '"':
                current.append('"')
                i += 1
            elif char == '"':
                in_quotes = False
            else:
                current.append(char)
        elif char == '"':
            in_quotes = True
        elif char == sep:
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    fields.append("".join(current))
    return fields
