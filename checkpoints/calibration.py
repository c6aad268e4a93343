"""The fixed text that int8 calibration runs through the float model (activation ranges for
SmoothQuant-style smoothing, see checkpoints/smoothing.py). Written for this project: a mix of
narrative, dialogue, instructions, factual prose, code and numbers, so that the activation
maxima are not those of one register. It shares nothing with the perplexity text of
tools/bench_quality.py (Shakespeare)."""

CALIBRATION_TEXT = """\
The lighthouse keeper had not spoken to anyone in eleven days when the supply boat finally \
rounded the point. She watched it from the gallery, one hand on the cold iron rail, counting the \
strokes of the oars the way her father had taught her. The sea was grey and patient. Gulls turned \
above the landing stage, and somewhere below the rocks a seal barked twice and was silent.

"You're late," she called down, when the boat scraped against the stones.
"Weather," said the young man at the oars. "And the engine's gone again. I rowed the last mile."
"Then you'll want tea."
"I'll want a great deal more than tea," he said, and laughed, and began to pass up the crates.

How to make a simple loaf of bread. Mix 500 g of strong white flour with 7 g of dried yeast and \
10 g of salt. Add 320 ml of warm water and 2 tablespoons of olive oil, then knead for ten minutes \
until the dough is smooth and elastic. Leave it in a covered bowl for an hour, or until it has \
doubled in size. Shape it, let it rise again for 45 minutes, and bake at 220 degrees Celsius for \
30 to 35 minutes. The loaf is done when it sounds hollow if you tap the bottom.

Photosynthesis is the process by which green plants, algae and some bacteria turn light energy \
into chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light; water \
is split, oxygen is released, and the energy is stored in ATP and NADPH. The Calvin cycle then \
uses that energy to fix carbon dioxide into sugars. Roughly 120 billion tonnes of carbon are \
fixed this way on land every year.

Q: What is the difference between a list and a tuple in Python?
A: A list is mutable: you can append, remove or change its items. A tuple is immutable, so it \
can be used as a dictionary key or stored in a set, and it is slightly cheaper to create.

def merge_sorted(a, b):
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

print(merge_sorted([1, 4, 9], [2, 3, 10, 12]))  # [1, 2, 3, 4, 9, 10, 12]

Dear Ms. Okafor,
Thank you for your letter of 14 March. I am pleased to confirm that the meeting will take place \
on Tuesday at 10:30 in room 4B. Please bring the revised budget figures and the signed contract. \
If you have any questions, you can reach me at the number below.
Kind regards,
Daniel Weiss

The Silk Road was never a single road. It was a shifting web of caravan routes, river crossings \
and sea lanes that linked China, Central Asia, Persia, Arabia and the Mediterranean for more than \
fifteen centuries. Along it moved silk and spices, but also paper, glass, horses, religions, \
languages and diseases. Cities such as Samarkand, Bukhara and Kashgar grew rich on the trade.

Weather forecast for the weekend: Saturday will start cloudy with a chance of light rain in the \
morning, clearing by early afternoon. Highs of 17 C, lows of 9 C. Winds from the south-west at \
15 to 25 km/h. Sunday looks brighter, with sunshine for most of the day and a high of 21 C.

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders
WHERE created_at >= '2023-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 5
ORDER BY revenue DESC
LIMIT 20;

"Are you sure this is the right way?" asked Tom, peering at the map.
"Absolutely not," Maria replied. "But the other way had a bull in it."
They walked on in silence for a while. The path climbed through beech woods, then out onto an \
open ridge where the wind tugged at their jackets and the whole valley lay spread out below them: \
the river, the railway, the grey roofs of the village, and the church spire catching the sun.

To solve 3x + 7 = 22, subtract 7 from both sides to get 3x = 15, then divide by 3: x = 5. \
Check: 3 * 5 + 7 = 15 + 7 = 22. The area of a circle with radius 4 cm is pi * 4^2, about 50.27 \
square centimetres. 15% of 240 is 36, and 2 to the power of 10 is 1024.

Les enfants jouaient dans le jardin pendant que leurs parents préparaient le dîner. \
Der Zug nach München fährt um halb acht vom Gleis drei ab. \
El mercado abre todos los días a las nueve de la mañana.

Tips for a better night's sleep: go to bed and get up at the same time every day, keep your \
bedroom cool, dark and quiet, avoid caffeine after midday, and put screens away at least an hour \
before bed. If you cannot fall asleep after twenty minutes, get up and do something calm until \
you feel tired.
"""
