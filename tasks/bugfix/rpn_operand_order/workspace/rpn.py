"""Evaluate reverse Polish notation: '3 4 + 2 *' -> 14."""
import operator

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def evaluate(expression: str) -> float:
    stack: list[float] = []
    for token in expression.split():
        if token in OPS:
            if len(stack) < 2:
                raise ValueError(f"not enough operands for {token!r}")
            left = stack.pop()
            right = stack.pop()
            stack.append(OPS[token](left, right))
        else:
            stack.append(float(token))
    if len(stack) != 1:
        raise ValueError("malformed expression")
    return stack[0]
