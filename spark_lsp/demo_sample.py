"""A small inventory module: the sample file `spark-lsp demo` types into."""

from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)


class Inventory:
    def __init__(self):
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.name in self.items:
            self.items[item.name].quantity += item.quantity
        else:
            self.items[item.name] = item

    def remove(self, name: str, quantity: int = 1) -> None:
        item = self.items[name]
        if item.quantity < quantity:
            raise ValueError(f"only {item.quantity} {name} left")
        item.quantity -= quantity

    def total_value(self) -> float:
        return sum(item.price * item.quantity for item in self.items.values())

    def by_tag(self, tag: str) -> list[Item]:
        return [item for item in self.items.values() if tag in item.tags]


def cheapest(items: list[Item]) -> Item:
    best = items[0]
    for item in items[1:]:
        if item.price < best.price:
            best = item
    return best


def main():
    inventory = Inventory()
    inventory.add(Item("apple", 0.5, 10, ["fruit"]))
    inventory.add(Item("pear", 0.75, 4, ["fruit"]))
    print(inventory.total_value())
